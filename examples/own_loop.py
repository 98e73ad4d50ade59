"""SZO in your own training loop, on a SpikingJelly network whose forward does not reset itself."""
import torch
from sklearn.datasets import load_digits
from spikingjelly.activation_based import functional, layer, neuron
from torch import nn

from subspace_store import SubspaceStore, build_subspace
from szo.optim import SZO
from szo.trajectory import TrajectoryRecorder

torch.manual_seed(0)
T = 4
def make_model():  # multi-step SpikingJelly layers: [T, N, 1, 8, 8] -> [T, N, 10]
    net = nn.Sequential(layer.Conv2d(1, 8, 3, padding=1, bias=False), layer.BatchNorm2d(8),
                        neuron.LIFNode(tau=2.0), layer.Flatten(), layer.Linear(8 * 8 * 8, 10))
    functional.set_step_mode(net, "m")
    return net

digits = load_digits()
x_all = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1).div(16).repeat(T, 1, 1, 1, 1)
y_all = torch.tensor(digits.target)
train = list(zip(x_all[:, :1400].split(64, dim=1), y_all[:1400].split(64)))
x_test, y_test = x_all[:, 1400:], y_all[1400:]


def loss_fn(out, y):  # out: [T, N, 10] -> the mean over time is the prediction
    return nn.functional.cross_entropy(out.mean(0), y)


# 1. BPTT for 3 epochs, recording the weight trajectory (initial weights + one sample per epoch)
teacher = make_model()
rec = TrajectoryRecorder("runs/own/trajectory", teacher)
rec.on_train_start()
sgd = torch.optim.SGD(teacher.parameters(), lr=0.1, momentum=0.9)
for epoch in range(1, 4):
    for x, y in train:
        functional.reset_net(teacher)
        sgd.zero_grad()
        loss_fn(teacher(x), y).backward()
        sgd.step()
    rec.on_epoch_end(epoch, step=epoch * len(train))

# 2. centered PCA of the trajectory (k = 3 directions) into the subspace store
store = SubspaceStore("runs/own/subspaces")
store.save("own-k3", build_subspace("runs/own/trajectory", k=3, progress=False), overwrite=True)

# 3. forward-only training of a fresh (differently initialised) model inside the subspace. SZO(model, ...) moves the
# parameters to subspace.reference (the trajectory's first sample; start="current" keeps them),
# freezes BN across the probes, resets the neurons before every probe, and after each update
# runs one unperturbed forward that updates the BN statistics (bn_update="recompute"). Its default step is
# scale-free: mu 0.3 and lr 0.03 in units of the subspace's spread (scale="absolute": the paper's mu 1, lr 1).
model = make_model()
subspace = store.load("own-k3", model=model)  # checks the parameter layout
opt = SZO(model, subspace, momentum=0.9, estimator="cge")
for epoch in range(2):
    for x, y in train:
        loss = opt.step(lambda: loss_fn(model(x), y))  # forward only: no autograd graph is built

model.eval()
functional.reset_net(model)
with torch.no_grad():
    acc = (model(x_test).mean(0).argmax(1) == y_test).float().mean().item()
print(f"SZO-CGE, k = 3, 2 epochs: test accuracy {acc:.4f}, {opt.forward_passes} forwards, 0 backwards")
