package kafkaclient_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/kafkaclient"
	"github.com/deferq/scheduler/internal/kafkatest"
)

const (
	topic    = "secured"
	user     = "scheduler"
	password = "right-Pa55word"
	wrong    = "wrong-Pa55word"
	// timeout is KAFKA_TIMEOUT. Generous, since TLS handshakes of many
	// parallel cases share two cores with the race detector; the cases that
	// wait for it out run in parallel.
	timeout = 2 * time.Second
)

// allUsers is the same user and password under every mechanism kfake has.
var allUsers = []kafkatest.User{
	{Mechanism: "PLAIN", Name: user, Password: password},
	{Mechanism: "SCRAM-SHA-256", Name: user, Password: password},
	{Mechanism: "SCRAM-SHA-512", Name: user, Password: password},
}

// Each case starts a kfake broker with some security, builds the client
// configuration from Settings, and either round-trips a record (produce, then
// consume it back) or expects every way the service connects (a client, as
// the producer and the consumer group make, and a single broker connection, as
// the readiness probe makes) to fail soon, saying why.
func TestSecurity(t *testing.T) {
	pki := kafkatest.NewPKI(t)
	other := kafkatest.NewPKI(t) // a CA the brokers' certificates do not come from

	plain := kafkatest.Broker{}
	withTLS := kafkatest.Broker{TLS: pki.ServerTLS(false)}
	mutualTLS := kafkatest.Broker{TLS: pki.ServerTLS(true)}
	sasl := kafkatest.Broker{Users: allUsers}
	tlsSASL := kafkatest.Broker{TLS: pki.ServerTLS(false), Users: allUsers}
	scram := func(mech, pass string) kafkaclient.Settings {
		return kafkaclient.Settings{SASLMechanism: mech, SASLUser: user, SASLPassword: pass}
	}
	tlsCA := kafkaclient.Settings{TLS: true, TLSCAFile: pki.CAFile}
	with := func(a, b kafkaclient.Settings) kafkaclient.Settings {
		a.SASLMechanism, a.SASLUser, a.SASLPassword = b.SASLMechanism, b.SASLUser, b.SASLPassword
		return a
	}

	for _, tc := range []struct {
		name     string
		broker   kafkatest.Broker
		settings kafkaclient.Settings
		wantErr  []string // substrings of the error; none: the round trip works
		// probeOK: the single connection asking for ApiVersions succeeds
		// even though clients fail, since brokers answer ApiVersions
		// before authentication.
		probeOK bool
	}{
		{name: "plaintext", broker: plain},
		{name: "TLS verified with the CA file", broker: withTLS, settings: tlsCA},
		{name: "TLS without verification", broker: withTLS, settings: kafkaclient.Settings{TLS: true, TLSInsecureSkipVer: true}},
		{name: "mutual TLS", broker: mutualTLS, settings: kafkaclient.Settings{TLS: true, TLSCAFile: pki.CAFile,
			TLSCertFile: pki.ClientCertFile, TLSKeyFile: pki.ClientKeyFile}},
		{name: "SASL PLAIN", broker: sasl, settings: scram("PLAIN", password)},
		{name: "SASL SCRAM-SHA-256", broker: sasl, settings: scram("SCRAM-SHA-256", password)},
		{name: "SASL SCRAM-SHA-512", broker: sasl, settings: scram("SCRAM-SHA-512", password)},
		{name: "TLS and SCRAM-SHA-512", broker: tlsSASL, settings: with(tlsCA, scram("SCRAM-SHA-512", password))},
		{name: "TLS and PLAIN", broker: tlsSASL, settings: with(tlsCA, scram("PLAIN", password))},

		{name: "PLAIN wrong password", broker: sasl, settings: scram("PLAIN", wrong),
			wantErr: []string{`SASL PLAIN authentication as user "scheduler" failed`, "wrong user or password"}},
		{name: "SCRAM-SHA-256 wrong password", broker: sasl, settings: scram("SCRAM-SHA-256", wrong),
			wantErr: []string{`SASL SCRAM-SHA-256 authentication as user "scheduler" failed`}},
		{name: "SCRAM-SHA-512 wrong password", broker: sasl, settings: scram("SCRAM-SHA-512", wrong),
			wantErr: []string{`SASL SCRAM-SHA-512 authentication as user "scheduler" failed`}},
		{name: "SCRAM-SHA-512 unknown user", broker: sasl,
			settings: kafkaclient.Settings{SASLMechanism: "SCRAM-SHA-512", SASLUser: "nobody", SASLPassword: password},
			wantErr:  []string{`SASL SCRAM-SHA-512 authentication as user "nobody" failed`}},
		{name: "TLS and SCRAM-SHA-512 wrong password", broker: tlsSASL, settings: with(tlsCA, scram("SCRAM-SHA-512", wrong)),
			wantErr: []string{`SASL SCRAM-SHA-512 authentication as user "scheduler" failed`}},
		{name: "no SASL at a SASL broker", broker: sasl,
			wantErr: []string{"closed the connection after answering only ApiVersions (does it require SASL authentication?)"},
			probeOK: true},
		{name: "untrusted CA", broker: withTLS, settings: kafkaclient.Settings{TLS: true, TLSCAFile: other.CAFile},
			wantErr: []string{"TLS handshake with 127.0.0.1:", "not signed by a CA trusted by " + other.CAFile, "certificate signed by unknown authority"}},
		{name: "system roots do not trust a private CA", broker: withTLS, settings: kafkaclient.Settings{TLS: true},
			wantErr: []string{"not signed by a CA trusted by the system roots", "certificate signed by unknown authority"}},
		{name: "TLS client at a plaintext broker", broker: plain, settings: tlsCA,
			wantErr: []string{"TLS handshake with 127.0.0.1:", "no answer within " + timeout.String() + " (is the listener plaintext?)"}},
		{name: "plaintext client at a TLS broker", broker: withTLS,
			wantErr: []string{"closed the connection without answering the first request (does its listener expect TLS?)"}},
		{name: "mutual TLS without a client certificate", broker: mutualTLS, settings: tlsCA,
			wantErr: []string{"certificate required"}},
		{name: "mutual TLS with a certificate of another CA", broker: mutualTLS,
			settings: kafkaclient.Settings{TLS: true, TLSCAFile: pki.CAFile, TLSCertFile: other.ClientCertFile, TLSKeyFile: other.ClientKeyFile},
			wantErr:  []string{"unknown certificate authority"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := tc.broker
			b.Topics = []string{topic}
			addr := kafkatest.Start(t, b)
			s := tc.settings
			s.Version, s.ClientID, s.Timeout = "3.6.0", "kafkaclient-test", timeout
			if tc.wantErr == nil {
				roundTrip(t, addr, s)
				if err := probe(t, addr, s); err != nil {
					t.Errorf("probe: %v", err)
				}
				return
			}

			conf := config(t, s)
			// Every network step is bounded by the timeout; the client
			// retries its first metadata request Retry.Max times. Twice
			// that: under the race detector, with the whole suite running
			// on two cores, one run took 15.1 s against 11 s. What this
			// catches is a step left to sarama's own defaults (30 s per
			// dial, over two minutes in all), not a slow machine.
			bound := 2 * (time.Duration(conf.Metadata.Retry.Max+1)*(timeout+conf.Metadata.Retry.Backoff) + timeout)
			start := time.Now()
			client, err := sarama.NewClient([]string{addr}, conf)
			took := time.Since(start)
			if err == nil {
				client.Close()
				t.Fatal("client connected, want an error")
			}
			checkErr(t, "client", err, tc.wantErr)
			if took > bound {
				t.Errorf("client failed after %v, want within %v", took, bound)
			}
			if !errors.Is(err, sarama.ErrOutOfBrokers) {
				t.Errorf("client error %v does not wrap sarama.ErrOutOfBrokers: callers match on it", err)
			}

			if tc.probeOK {
				if err := probe(t, addr, s); err != nil {
					t.Errorf("probe: %v, want success (ApiVersions needs no authentication)", err)
				}
				return
			}
			start = time.Now()
			err = probe(t, addr, s)
			took = time.Since(start)
			if err == nil {
				t.Fatal("probe succeeded, want an error")
			}
			checkErr(t, "probe", err, tc.wantErr)
			if took > 2*timeout {
				t.Errorf("probe failed after %v, want within KAFKA_TIMEOUT (%v) and some slack", took, timeout)
			}
		})
	}
}

func checkErr(t *testing.T, what string, err error, want []string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s error %q does not contain %q", what, err, w)
		}
	}
	for _, secret := range []string{password, wrong} {
		if strings.Contains(err.Error(), secret) {
			t.Errorf("%s error %q shows a password", what, err)
		}
	}
}

func config(t *testing.T, s kafkaclient.Settings) *sarama.Config {
	t.Helper()
	c, err := s.Config()
	if err != nil {
		t.Fatalf("Config: %v", err)
	}
	return c
}

// probe opens one connection and asks for the API versions, as the
// service's readiness check does.
func probe(t *testing.T, addr string, s kafkaclient.Settings) error {
	t.Helper()
	b := sarama.NewBroker(addr)
	if err := b.Open(config(t, s)); err != nil {
		return err
	}
	defer b.Close()
	_, err := b.ApiVersions(&sarama.ApiVersionsRequest{})
	return err
}

// roundTrip produces a record with s and reads it back with s.
func roundTrip(t *testing.T, addr string, s kafkaclient.Settings) {
	t.Helper()
	pc := config(t, s)
	pc.Producer.Return.Successes = true
	pc.Producer.RequiredAcks = sarama.WaitForAll
	producer, err := sarama.NewSyncProducer([]string{addr}, pc)
	if err != nil {
		t.Fatalf("producer: %v", err)
	}
	defer producer.Close()
	sent := &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder("k"), Value: sarama.StringEncoder("v:" + t.Name()),
		Headers: []sarama.RecordHeader{{Key: []byte("h"), Value: []byte("x")}}}
	part, off, err := producer.SendMessage(sent)
	if err != nil {
		t.Fatalf("produce: %v", err)
	}

	consumer, err := sarama.NewConsumer([]string{addr}, config(t, s))
	if err != nil {
		t.Fatalf("consumer: %v", err)
	}
	defer consumer.Close()
	pcons, err := consumer.ConsumePartition(topic, part, off)
	if err != nil {
		t.Fatalf("consume %s/%d at %d: %v", topic, part, off, err)
	}
	defer pcons.Close()
	select {
	case m := <-pcons.Messages():
		if string(m.Key) != "k" || string(m.Value) != "v:"+t.Name() || len(m.Headers) != 1 || string(m.Headers[0].Value) != "x" {
			t.Errorf("read key %q value %q headers %d, want what was produced", m.Key, m.Value, len(m.Headers))
		}
	case err := <-pcons.Errors():
		t.Fatalf("consume: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the produced record was not read back within 10s")
	}
}

// The readiness probe shortens Net.DialTimeout after Config; the TLS
// handshake, done by the dialer, must honour it rather than the timeout the
// settings had.
func TestDialTimeoutSetAfterConfigBoundsTheHandshake(t *testing.T) {
	pki := kafkatest.NewPKI(t)
	addr := kafkatest.Start(t, kafkatest.Broker{}) // plaintext: a TLS client waits for an answer that never comes
	s := kafkaclient.Settings{Version: "3.6.0", Timeout: 30 * time.Second, TLS: true, TLSCAFile: pki.CAFile}
	conf := config(t, s)
	conf.Net.DialTimeout = 300 * time.Millisecond
	b := sarama.NewBroker(addr)
	start := time.Now()
	if err := b.Open(conf); err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	_, err := b.ApiVersions(&sarama.ApiVersionsRequest{})
	if took := time.Since(start); err == nil || took > 5*time.Second {
		t.Fatalf("ApiVersions over TLS to a plaintext broker: %v after %v, want a handshake error within 300ms and some slack", err, took)
	}
	if !strings.Contains(err.Error(), "no answer within 300ms") {
		t.Errorf("error %q does not name the shortened timeout", err)
	}
}

func TestConfigErrors(t *testing.T) {
	pki := kafkatest.NewPKI(t)
	base := kafkaclient.Settings{Version: "3.6.0", Timeout: time.Second}
	for _, tc := range []struct {
		name string
		edit func(*kafkaclient.Settings)
		want string
	}{
		{"bad version", func(s *kafkaclient.Settings) { s.Version = "x" }, `kafka version "x"`},
		{"missing CA file", func(s *kafkaclient.Settings) { s.TLS, s.TLSCAFile = true, "/nonexistent/ca.pem" }, "TLS CA file: open /nonexistent/ca.pem"},
		{"CA file without a certificate", func(s *kafkaclient.Settings) { s.TLS, s.TLSCAFile = true, pki.ClientKeyFile },
			"TLS CA file " + pki.ClientKeyFile + ": no PEM certificate found"},
		{"certificate without key", func(s *kafkaclient.Settings) { s.TLS, s.TLSCertFile = true, pki.ClientCertFile },
			"TLS client certificate and key must be set together"},
		{"key that does not match", func(s *kafkaclient.Settings) {
			s.TLS, s.TLSCertFile, s.TLSKeyFile = true, pki.ClientCertFile, pki.ServerKeyFile
		}, "TLS client certificate: tls: private key does not match public key"},
		{"unknown mechanism", func(s *kafkaclient.Settings) { s.SASLMechanism, s.SASLUser = "GSSAPI", "u" },
			`SASL mechanism "GSSAPI": want one of [PLAIN SCRAM-SHA-256 SCRAM-SHA-512]`},
		{"mechanism without user", func(s *kafkaclient.Settings) { s.SASLMechanism = "SCRAM-SHA-512" }, "SASL mechanism SCRAM-SHA-512 needs a user"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := base
			tc.edit(&s)
			_, err := s.Config()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Config() error = %v, want one containing %q", err, tc.want)
			}
		})
	}
}
