__version__ = "0.3.12.dev0"
