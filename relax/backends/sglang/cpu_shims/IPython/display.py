"""Stub of IPython.display: `HTML` keeps its text, `display` prints it."""


class HTML:
    def __init__(self, data=None, *args, **kwargs):
        self.data = data

    def __repr__(self):
        return f"HTML({self.data!r})"


def display(*objs, **kwargs):
    for obj in objs:
        print(getattr(obj, "data", obj))
