"""Generic file helpers every stage uses: the guarded opener for untrusted inputs, path
containment, zip members, atomic file and folder writers, hashing."""
