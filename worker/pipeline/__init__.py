"""The round pipeline of one step: gradient frames pushed, the round's decision, parameter frames pulled back."""
