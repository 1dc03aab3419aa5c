"""Built-in resize policies, installed as `dynaresized.policies` and registered under the
entry-point group of the same name. Each is a pure function of an `ObservedView`."""
