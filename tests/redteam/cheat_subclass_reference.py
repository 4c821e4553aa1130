"""Exploit class: subclassing the reference with nothing changed."""

from task_rmsnorm import Model


class ModelNew(Model):
    pass
