"""Speculative decoding: proposers draft tokens, the target model scores them in one forward
pass, and rejection sampling keeps the output distribution exactly the target's."""
