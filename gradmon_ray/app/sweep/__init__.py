"""``gradmon-ray tune``: the sweep file (``config``), the sweep (``run``), one trial (``trials``), what
it prints (``progress``) and the command (``command``).  Import each name from its module: this
package re-exports nothing."""
