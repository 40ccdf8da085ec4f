//! What of a request identifies it, how it is recorded, and where two requests first differ.
