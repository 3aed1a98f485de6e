"""What every layer uses: settings declared on config dataclasses, safe file I/O, devices, start-up."""
