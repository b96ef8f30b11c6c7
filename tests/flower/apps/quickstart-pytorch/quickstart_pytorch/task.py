# ruff: noqa
# Flower's own `flwr new` template output: flwr 1.24.0 (the last release that ships
# the templates) app/code/task.pytorch.py.tpl, rendered with string.Template as `flwr new`
# does. Unmodified except the data loading: `load_data` reads a generated CIFAR-shaped data set (see below)
# instead of downloading CIFAR-10 with flwr-datasets (no internet in tests).
"""quickstart-pytorch: A Flower / PyTorch app."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


# -- data loading: the one part changed from Flower's template -----------------------------
# A generated CIFAR-shaped data set (3x32x32 images, 10 classes) in place of CIFAR-10: each
# class is a fixed random smooth pattern, each image its class's pattern under noise and a
# random brightness. 2,400 images, split IID over the partitions; each partition keeps 80%
# for training and 20% for testing, as the template does.
NUM_IMAGES = 2400


def _images(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(10, 3, 8, 8, generator=gen)
    patterns = F.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)
    labels = torch.randint(0, 10, (NUM_IMAGES,), generator=gen)
    scale = 0.5 + torch.rand(NUM_IMAGES, 1, 1, 1, generator=gen)
    noise = 2.0 * torch.randn(NUM_IMAGES, 3, 32, 32, generator=gen)
    return (scale * patterns[labels] + noise).clamp(-3, 3), labels


class _Partition(torch.utils.data.Dataset):
    """Rows as the template's batches hold them: {"img": ..., "label": ...}."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"img": self.images[i], "label": self.labels[i]}


def load_data(partition_id: int, num_partitions: int):
    """Load partition of the generated CIFAR-shaped data."""
    images, labels = _images()
    idx = torch.arange(partition_id, NUM_IMAGES, num_partitions)
    # Divide data on each node: 80% train, 20% test
    perm = idx[torch.randperm(len(idx), generator=torch.Generator().manual_seed(42))]
    cut = int(0.8 * len(perm))
    train, test = perm[:cut], perm[cut:]
    # Construct dataloaders
    trainloader = DataLoader(_Partition(images[train], labels[train]), batch_size=32,
                             shuffle=True)
    testloader = DataLoader(_Partition(images[test], labels[test]), batch_size=32)
    return trainloader, testloader
# -- end of the changed part ------------------------------------------------------------------


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / len(trainloader)
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    net.eval()
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
