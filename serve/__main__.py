from serve.cli import entry

entry()
