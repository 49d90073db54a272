"""Multi-backend router: one OpenAI endpoint in front of many engine servers.

Importing this package is cheap (the `pagoda` CLI imports `pagoda.router.cli` for `--help`); the
server parts live in `pagoda.router.app` and `pagoda.router.launch`.
"""
