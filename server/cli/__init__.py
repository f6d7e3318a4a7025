"""The `fdserve` command line and the client settings it prints."""
