//! The emulated cluster itself: up/down/idempotence and its layout.

use erarctl::testbed::{self, fmt_mac, host_ip, host_mac, TestbedConfig, UpOutcome};
use rust_tests::{testbed_config, testbed_lock, TESTBED_HOSTS};

#[test]
fn up_is_idempotent_and_down_removes_everything() {
    let _lock = testbed_lock();
    let cfg = testbed_config();

    testbed::down(false).expect("down (is someone else running jobs on the test bed?)");
    let st = testbed::status().expect("status");
    assert!(st.is_absent(), "after down something is left:\n{st}");

    assert_eq!(testbed::up(&cfg).expect("up"), UpOutcome::Created);
    assert_eq!(testbed::up(&cfg).expect("up again"), UpOutcome::Unchanged);

    // Other parameters rebuild; going back rebuilds again.
    let small = TestbedConfig { hosts: 2, ..cfg };
    assert_eq!(testbed::up(&small).expect("up 2"), UpOutcome::Rebuilt);
    assert_eq!(testbed::status().expect("status").hosts.len(), 2);
    assert_eq!(testbed::up(&cfg).expect("up back"), UpOutcome::Rebuilt);

    let st = testbed::status().expect("status");
    assert!(st.is_healthy(), "{st}");
    assert_eq!(st.hosts.len(), TESTBED_HOSTS);
    assert_eq!(st.mtu(), Some(cfg.mtu));
    assert_eq!(st.switch, Some(cfg.switch));
    for h in &st.hosts {
        let i = h.index;
        assert_eq!(h.netns(), format!("erar-h{i}"));
        assert_eq!(
            h.eth0_addr.as_deref(),
            Some(format!("{}/24", host_ip(i)).as_str())
        );
        let eth0 = h.eth0.as_ref().expect("eth0");
        let port = h.port_link.as_ref().expect("bridge port");
        assert_eq!(eth0.mac.as_deref(), Some(fmt_mac(&host_mac(i)).as_str()));
        assert_eq!(eth0.mtu, Some(cfg.mtu));
        assert_eq!(port.mtu, Some(cfg.mtu));
        assert_eq!(port.master.as_deref(), Some("erar-br0"));
    }
}

#[test]
fn hosts_reach_each_other_at_full_mtu() {
    let _tb = rust_tests::testbed();
    let mtu = testbed_config().mtu;
    // ICMP payload that fills the MTU exactly, fragmentation forbidden.
    let size = (mtu - 28).to_string();
    for (from, to) in [(0usize, TESTBED_HOSTS - 1), (TESTBED_HOSTS - 1, 0), (1, 2)] {
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &format!("erar-h{from}"),
                "ping",
                "-c",
                "1",
                "-W",
                "2",
            ])
            .args(["-M", "do", "-s", &size, &host_ip(to).to_string()])
            .output()
            .expect("run ping");
        assert!(
            out.status.success(),
            "ping from host {from} to host {to} with {size}-byte payload failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
