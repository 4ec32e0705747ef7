"""Evidence with provenance: sealed stage evidence, the verdict's attestation, evidence read back."""
