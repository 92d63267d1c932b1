"""python -m gemini.scheduler: same as gem-schd."""
from gemini.scheduler.cli import main

main(prog_name="gem-schd")
