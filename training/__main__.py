from training.cli import entry

entry()
