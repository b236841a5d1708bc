"""One module per CLI command, each exposing a click ``command``. Import only click here."""
