"""Backends: where a program's requests run (pl.Engine in-process, pl.RuntimeEndpoint over HTTP)."""
