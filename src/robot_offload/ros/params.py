"""Read a node's private parameters into a config dataclass, once, at start.

Each dataclass field is a ``~name`` parameter with the field's default; the pure layer's
``validate()`` then checks the values, so a bad launch file fails at start with a message
naming the parameter, not at the first frame.
"""

import dataclasses
import os

import rospy

from robot_offload import auth
from robot_offload.errors import ConfigError


def load_params(config_type, **overrides):
    values = {}
    for f in dataclasses.fields(config_type):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif rospy.has_param("~" + f.name):
            value = rospy.get_param("~" + f.name)
            if isinstance(value, list):
                value = tuple(value)
            values[f.name] = value
    config = config_type(**values)
    config = config.validate() if hasattr(config, "validate") else config
    rospy.loginfo("%s configuration: %s", rospy.get_name(),
                  ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(config).items()))
    return config


def load_auth_secret():
    """The node's shared secret for request authentication, or None (off).

    From the file named by ``~auth_secret_file`` (mode 0600), else from the environment
    variable ``ROBOT_OFFLOAD_SECRET``; never from the parameter server, which any node can
    read and ``rosbag``/``rosparam dump`` would copy: a ``~auth_secret`` parameter is
    refused. Logs whether authentication is on, never the secret."""
    if rospy.has_param("~auth_secret"):
        raise ConfigError(f"{rospy.resolve_name('~auth_secret')}: secrets do not belong on the "
                          "parameter server; put it in a file (chmod 600) and set ~auth_secret_file")
    path = str(rospy.get_param("~auth_secret_file", "") or "")
    secret = auth.load_secret(path)
    if secret is None:
        rospy.loginfo("%s: request authentication off (no ~auth_secret_file, no $%s)",
                      rospy.get_name(), auth.ENV_VAR)
    else:
        rospy.loginfo("%s: request authentication on (secret from %s)", rospy.get_name(),
                      path or "$" + auth.ENV_VAR)
    return secret


def load_server_auth():
    """``(shared secret, per-client keys)`` of the offload server; at most one is set,
    both None means authentication off.

    ``~auth_keys_file`` (mode 0600, ``client_id: secret`` lines, see
    :func:`robot_offload.auth.parse_keys`) gives each client its own key, so a client can
    only act as its own client_id; otherwise the shared secret of :func:`load_auth_secret`.
    Setting both files is refused (which would apply is ambiguous); with a keys file,
    ``$ROBOT_OFFLOAD_SECRET`` is ignored and that is logged. Keys are never parameters
    (an ``~auth_keys`` parameter is refused) and never logged, only their number."""
    if rospy.has_param("~auth_keys"):
        raise ConfigError(f"{rospy.resolve_name('~auth_keys')}: keys do not belong on the parameter "
                          "server; put them in a file (chmod 600) and set ~auth_keys_file")
    path = str(rospy.get_param("~auth_keys_file", "") or "")
    if not path:
        return load_auth_secret(), None
    if rospy.get_param("~auth_secret_file", ""):
        raise ConfigError(f"{rospy.get_name()}: set ~auth_keys_file (per-client keys) or "
                          "~auth_secret_file (one shared secret), not both")
    if rospy.has_param("~auth_secret"):
        raise ConfigError(f"{rospy.resolve_name('~auth_secret')}: secrets do not belong on the "
                          "parameter server")
    keys = auth.load_keys(path)
    if auth.ENV_VAR in os.environ:
        rospy.logwarn("%s: $%s is ignored: per-client keys from %s", rospy.get_name(),
                      auth.ENV_VAR, path)
    rospy.loginfo("%s: request authentication on, per-client keys (%d clients) from %s",
                  rospy.get_name(), len(keys), path)
    return None, keys
