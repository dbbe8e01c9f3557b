//! Integration-test helpers shared by the files under tests/.
