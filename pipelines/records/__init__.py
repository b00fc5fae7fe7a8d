"""A study's progress as small JSON records: one per finished search trial and per finished reproduction, plus the
study's header (its protocol fingerprint).  Records hold no weights and no MLflow store; they can be committed,
copied and continued from on any machine (docs/records.md)."""
