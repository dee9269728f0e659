"""The command line's tools beyond training: bench (train-step and input timing), runs (list and
plot runs) and launch (start a job of several processes on this host).
"""
