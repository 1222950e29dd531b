"""A minimal turbospark family plugin: a Llama-style decoder in two small modules."""
