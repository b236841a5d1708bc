"""Files, for every stage: the guarded opener and parsers for untrusted inputs, path containment,
zip members, output rules, atomic file and folder writers, hashing."""
