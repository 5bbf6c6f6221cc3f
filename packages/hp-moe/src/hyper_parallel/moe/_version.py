__version__ = "0.1.6.dev0"
