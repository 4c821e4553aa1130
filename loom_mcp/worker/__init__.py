"""Code that runs inside sandboxed worker processes (never imported by the server process).

Keep imports here light: `protocol` is loaded before any heavy framework in every worker.
"""
