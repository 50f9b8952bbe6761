"""One exception type for every user mistake: the CLI prints it and exits with code 2."""


class UsageError(Exception):
    """Bad input (recipe, checkpoint, option). ``fix`` tells the user what to do about it."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem, self.fix = problem, fix
        super().__init__(problem if fix is None else f"{problem}\n  fix: {fix}")
