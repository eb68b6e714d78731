"""One training run: the loop (:mod:`.train`) and what it is built from (:mod:`.training`,
:mod:`.schedule`, :mod:`.parallel`), its checkpoints (:mod:`.checkpoint`, :mod:`.dist_checkpoint`,
:mod:`.state`, :mod:`.rng`), its run directory (:mod:`.run_dir`) and its logs (:mod:`.metrics`,
:mod:`.peak_memory`). Importing this package imports nothing else: :mod:`.launch` is read by the
command line before torch is loaded."""
