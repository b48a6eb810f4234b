from memfit.cli import entry

entry()
