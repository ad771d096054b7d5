"""Stand-in for distutils (gone in Python 3.12); rosclean needs only spawn.find_executable."""
