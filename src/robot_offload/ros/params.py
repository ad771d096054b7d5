"""Read a node's private parameters into a config dataclass, once, at start.

Each dataclass field is a ``~name`` parameter with the field's default; the pure layer's
``validate()`` then checks the values, so a bad launch file fails at start with a message
naming the parameter, not at the first frame.
"""

import dataclasses

import rospy


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
