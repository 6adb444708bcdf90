"""The types every other package shares (request, batch, outputs, stats, validation); this
package imports no other package of the engine."""
