"""Python client for a specserve server: `from specserve.client import Client, AsyncClient`."""
