"""The application: ``gradmon-ray`` commands, training and sweep runs, checkpoints and resume.

The top layer: it may import every other package; nothing imports it.
"""
