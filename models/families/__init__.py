"""One module a model family: its decoder layer and model class (built from models/layers/) and
its config.json reader (hf_fields: what the readers share). The registry above
(pagedjax.models.registry) lists them; a family never imports it."""
