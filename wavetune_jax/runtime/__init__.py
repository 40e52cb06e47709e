"""What trace time imports: the selector, the tables and the wave model."""
