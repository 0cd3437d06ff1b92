"""verl compatibility (layer 1; no Ray): the table of verl's config keys -- mapped onto ours, accepted with a warning
saying why they have no effect here, or refused naming what to use instead (rules) -- and the command-line rewrite
that applies it before Hydra composes (compat).  It imports only core; the run's Hydra wiring and the scripts that
generate docs/verl_compat.md import it."""
