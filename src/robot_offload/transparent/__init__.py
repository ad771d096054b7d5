"""Transparent offloading of unmodified PyTorch programs (Cricket-style and RRTO).

``session`` intercepts operators on the robot, ``recorder`` finds the operator sequence of
an inference, ``server`` is the server's ``ops`` compute entry, ``wire`` the data format of
operator calls, ``launcher`` runs an unmodified program with interception switched on.
"""
