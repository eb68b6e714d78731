"""``fira-train sweep``: learning-rate grids over seeds, chosen on validation, reported on test
(:mod:`fira_train.sweep.driver`)."""
