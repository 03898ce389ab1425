"""The device plugin (`mpsagent.deviceplugin`): its servicer in-process."""
