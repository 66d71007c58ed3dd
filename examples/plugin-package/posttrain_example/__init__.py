"""An example third-party posttrain plugin package (see README.md)."""
