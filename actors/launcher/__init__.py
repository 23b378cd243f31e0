"""`ringserve serve`: starts NATS (unless given one) and every actor process, and watches them."""
