"""Helpers shared by the tests, imported one way: ``from support.X import ...``
(the tests folder is on the path). Scripts here also run as processes."""
