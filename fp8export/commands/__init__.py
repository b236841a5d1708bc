"""The CLI commands, one module each exposing a click ``command`` that translates options into a
config, calls ``fp8export.api`` and renders the result. Import only click here."""
