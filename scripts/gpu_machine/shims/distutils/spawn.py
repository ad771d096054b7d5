import shutil


def find_executable(name, path=None):
    return shutil.which(name, path=path)
