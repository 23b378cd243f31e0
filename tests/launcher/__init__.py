"""`ringserve serve`, its flags and its refusals before any actor starts (context length), and the repository's own
checks: docs, deploy/, import names and cycles, the GPU check script."""
