"""Training methods: the registry of names (:mod:`.registry`) and their factories (:mod:`.optimizers`,
:mod:`.lora`), the LLaMA model they train (:mod:`.model`) and pretrained models for fine-tuning
(:mod:`.pretrained`)."""
