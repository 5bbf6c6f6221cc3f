__version__ = "0.3.14.dev0"
