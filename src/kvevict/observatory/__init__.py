"""Attention observatory: the H2O paper's observations (sparsity, power-law accumulated
attention, heavy-hitter stability) and the RoCo paper's (attention variance settles) on any
model, plus a page showing which tokens a policy kept."""
