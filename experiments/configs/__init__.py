"""One ml_collections config file per experiment; each defines `get_config(arg=None)`."""
