"""One training run: the loop (:mod:`.train`, stopped by :mod:`.divergence`) and what it is built
from (:mod:`.training`, :mod:`.schedule`, :mod:`.parallel`), its checkpoints (:mod:`.checkpoint`,
:mod:`.dist_checkpoint`, :mod:`.state`, :mod:`.rng`; checked by :mod:`.checkpoint_integrity`,
:mod:`.safe_load` and, on resume, :mod:`.resume_check`), its run directory (:mod:`.run_dir`,
:mod:`.run_files`, :mod:`.run_lock`) and its logs (:mod:`.metrics`, :mod:`.peak_memory`).
Importing this package imports nothing else: :mod:`.launch` and :mod:`.process_logging` are read by
the command line before torch is loaded."""
