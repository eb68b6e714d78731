"""Reports built from finished run directories: the comparison table (:mod:`.markdown`) and curves
(:mod:`.plots`)."""
