"""Memory estimates without tensors: per weight matrix (:mod:`.matrix`, the paper's per-method
table) and for the paper's LLaMA sizes (:mod:`.estimates`, ``fira-train memory``)."""
