"""What a run is: the config dataclasses (:mod:`.run_config`), the recipes that fill them
(:mod:`.recipes`) and ``section.field=value`` overrides with the ``config.json`` round trip
(:mod:`.overrides`)."""
