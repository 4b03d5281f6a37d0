"""The `unweight` command line: parses, calls one library function per command, renders."""
